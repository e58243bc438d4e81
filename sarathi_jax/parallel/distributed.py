"""Multi-host start-up: `jax.distributed.initialize` from environment variables (see docs/parallelism.md).

    SARATHI_COORDINATOR_ADDRESS   host:port of process 0's coordinator (required to turn multi-host on)
    SARATHI_NUM_PROCESSES         number of processes (hosts), all started with the same program
    SARATHI_PROCESS_ID            this process's rank, 0 .. SARATHI_NUM_PROCESSES - 1
    SARATHI_LOCAL_DEVICE_IDS      optional, comma-separated local device ids this process uses
    SARATHI_TRANSFER_ADDRESS      optional, host:port this process listens on for cross-host device transfers
                                  (`jax_cross_host_transfer_socket_address`); needed for pipeline stages on
                                  different hosts when the backend has no native cross-host transfers (CPU)

Must run before anything initialises a JAX backend (the engine calls it first thing when it builds a
parallel runner; a program can call it itself earlier). Without SARATHI_COORDINATOR_ADDRESS it does nothing,
so single-host runs need no setting. After it, `jax.devices()` lists every process's devices and the
("pp", "tp") mesh is built over all of them (process 0's devices first).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

ENV_COORDINATOR_ADDRESS = "SARATHI_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "SARATHI_NUM_PROCESSES"
ENV_PROCESS_ID = "SARATHI_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "SARATHI_LOCAL_DEVICE_IDS"
ENV_TRANSFER_ADDRESS = "SARATHI_TRANSFER_ADDRESS"

_initialized = False


def initialize_distributed_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` from the SARATHI_* variables. True if it did (now or before)."""
    global _initialized
    env = os.environ if environ is None else environ
    address = env.get(ENV_COORDINATOR_ADDRESS)
    if not address:
        return False
    if _initialized:
        return True
    try:
        num_processes = int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID])
    except KeyError as e:
        raise ValueError(f"{ENV_COORDINATOR_ADDRESS} is set, so {e.args[0]} must be set too") from None
    except ValueError as e:
        raise ValueError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers: {e}") from None
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{ENV_PROCESS_ID}={process_id} is not in [0, {ENV_NUM_PROCESSES}={num_processes})")
    transfer_address = env.get(ENV_TRANSFER_ADDRESS)
    if transfer_address:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    local = env.get(ENV_LOCAL_DEVICE_IDS)
    local_device_ids = [int(i) for i in local.split(",")] if local else None
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    _initialized = True
    return True
