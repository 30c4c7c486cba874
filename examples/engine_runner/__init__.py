"""An engine-style CUDA-graph runner for the tiny decoder, and a gallery of its bugs.

``runner.py`` holds ``EngineRunner`` (static buffers, its own dispatch,
padding, capture and replay, as vLLM's, SGLang's and nano-vllm's model
runners do it, in miniature); ``buggy.py`` holds runners with one bug each;
``test_engine_runner.py`` asserts that ``verify_runner`` names each bug's
check and passes the correct runner.
"""
