"""Real models under the plugin: Hugging Face layers and torch's own, at tiny sizes.

Everything is built from config classes (or torch constructors) with seeded
random weights; nothing is downloaded. Hidden sizes are 32, one or two
layers, a vocabulary of 128, so that the whole folder runs in well under a
minute on the CPU emulator.

- ``hf_models``: a Llama decoder layer, a Qwen2 decoder layer, a GPT-2 block,
  a ViT encoder layer and a whole ``LlamaForCausalLM`` (needs ``transformers``,
  the ``hf`` extra).
- ``torch_models``: ``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``
  and a ResNet basic block (torch only).
- ``hf_bugs`` and ``torch_bugs``: planted bugs, each a realistic variant of one
  of those models, beside its correct twin.

The ``test_hf_*`` files skip cleanly without ``transformers``; the
``test_torch_*`` files never skip. See ``docs/real_models.md``.
"""
