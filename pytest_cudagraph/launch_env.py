"""Which rank this process is, when a launcher started it: read from the environment, no torch.

torchrun (``python -m torch.distributed.run``) and anything that sets its environment give
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` with ``MASTER_ADDR`` and ``MASTER_PORT``; Slurm's srun
gives ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` instead (the rendezvous address is
the job script's to export). The plugin reads this when it configures (which rank prints, which
writes the reports) and the distributed layer when it joins the ranks' process group; a process
group the suite made itself is seen there, where torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "LaunchEnvError", "from_environment"]


class LaunchEnvError(ValueError):
    """The launcher's environment is incomplete or malformed; the message says what to set."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place among the ranks a launcher started."""

    rank: int
    world_size: int
    local_rank: int
    #: "torchrun" (its variables, whoever set them) or "srun" (Slurm's).
    launcher: str
    #: The rendezvous address (None: not set; srun's job script exports them).
    master_addr: str | None
    master_port: int | None


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    if not text.strip().isdigit():
        raise LaunchEnvError(f"{name}={text!r} in the environment is not a whole number >= 0")
    return int(text)


def from_environment(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's ranks as the environment gives them, or None when no launcher started this
    process (torchrun's ``RANK`` and ``WORLD_SIZE`` absent, and no srun step of more than one task).

    torchrun's variables win over Slurm's: a torchrun started inside a Slurm job sets its own."""
    env = os.environ if environ is None else environ
    port = _integer(env, "MASTER_PORT")
    addr = env.get("MASTER_ADDR") or None
    rank, world = _integer(env, "RANK"), _integer(env, "WORLD_SIZE")
    if rank is not None or world is not None:
        if rank is None or world is None:
            given, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
            raise LaunchEnvError(
                f"{given} is set in the environment but {missing} is not: set both, as torchrun does"
            )
        local = _integer(env, "LOCAL_RANK")
        return _checked(rank, world, rank if local is None else local, "torchrun", addr, port)
    tasks, proc = _integer(env, "SLURM_NTASKS"), _integer(env, "SLURM_PROCID")
    if tasks is None or proc is None or tasks < 2:
        return None  # a Slurm allocation running one process: no ranks to join
    local = _integer(env, "SLURM_LOCALID")
    return _checked(proc, tasks, proc if local is None else local, "srun", addr, port)


def _checked(
    rank: int, world: int, local: int, launcher: str, addr: str | None, port: int | None
) -> LaunchEnv:
    if world < 1 or rank >= world:
        names = "RANK and WORLD_SIZE" if launcher == "torchrun" else "SLURM_PROCID and SLURM_NTASKS"
        raise LaunchEnvError(
            f"{names} say rank {rank} of {world}: a rank is a number from 0 to the world size - 1"
        )
    return LaunchEnv(rank, world, local, launcher, addr, port)
