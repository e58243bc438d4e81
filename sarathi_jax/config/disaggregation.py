"""Prefill/decode disaggregation's configuration: how devices split into a prefill side and a decode
side (`DisaggregationSplit`, `EngineConfig.disaggregation = "P:D"`), and the links a request's KV cache moves
over (`KVLink`, `KV_LINKS`). Plain Python, no JAX; the simulated engine is sarathi_jax/disagg/sim_engine.py.

A side is `DEVICES` or `DEVICES/TP`: DEVICES devices as DEVICES/TP instances of TP devices each (tensor
parallel inside an instance, requests spread over the instances). Plain "P:D" is one instance per side, tensor
parallel over all its devices: "4:4" is a TP-4 prefill instance and a TP-4 decode instance; "1:3/1" is one
prefill device and three decode instances of one device each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceGroup:
    """One side of the split: `devices` devices as instances of `tensor_parallel_size` devices each."""

    devices: int
    tensor_parallel_size: int

    @property
    def num_instances(self) -> int:
        return self.devices // self.tensor_parallel_size

    def __str__(self) -> str:
        tp = self.tensor_parallel_size
        return str(self.devices) if tp == self.devices else f"{self.devices}/{tp}"


@dataclass(frozen=True)
class DisaggregationSplit:
    """`prefill` devices run prompts (and sample each request's first token), `decode` devices the rest."""

    prefill: InstanceGroup
    decode: InstanceGroup

    @property
    def num_devices(self) -> int:
        return self.prefill.devices + self.decode.devices

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"

    @classmethod
    def parse(cls, text: str) -> DisaggregationSplit:
        """"P:D", each side DEVICES or DEVICES/TP (see the module docstring). ValueError naming the bad part."""
        if not isinstance(text, str) or text.count(":") != 1:
            raise ValueError(f"disaggregation must be 'P:D' (prefill devices:decode devices, e.g. '2:2'), got {text!r}")
        sides = []
        for name, part in zip(("prefill", "decode"), text.split(":")):
            devices, _, tp = part.strip().partition("/")
            try:
                n = int(devices)
                t = int(tp) if tp else n
            except ValueError:
                raise ValueError(f"disaggregation={text!r}: the {name} side {part!r} is not DEVICES or DEVICES/TP "
                                 "(positive integers)") from None
            if n < 1 or t < 1:
                raise ValueError(f"disaggregation={text!r}: the {name} side needs >= 1 device and tensor "
                                 f"parallelism >= 1, got {n} devices, TP {t}")
            if n % t:
                raise ValueError(f"disaggregation={text!r}: the {name} side's {n} devices do not make whole "
                                 f"instances of tensor parallelism {t} ({n} is not a multiple of {t})")
            sides.append(InstanceGroup(n, t))
        return cls(*sides)

    def check(self, num_devices: int, num_attention_heads: int, num_key_value_heads: int) -> None:
        """Raise ValueError when the split does not fit `num_devices`, or a side's tensor parallelism does not
        divide the model's heads (KV heads: one of them and TP must divide the other, as `parallel.plan` requires)."""
        if self.num_devices > num_devices:
            raise ValueError(f"disaggregation='{self}' needs {self.num_devices} devices ({self.prefill.devices} "
                             f"prefill + {self.decode.devices} decode), but only {num_devices} are available")
        for name, side in (("prefill", self.prefill), ("decode", self.decode)):
            tp = side.tensor_parallel_size
            if num_attention_heads % tp:
                hint = f"; as instances of fewer devices, e.g. '{side.devices}/1'" if tp > 1 else ""
                raise ValueError(f"disaggregation='{self}': the {name} side's tensor parallelism {tp} does not "
                                 f"divide the model's {num_attention_heads} attention heads{hint}")
            if num_key_value_heads % tp and tp % num_key_value_heads:
                raise ValueError(f"disaggregation='{self}': the {name} side's tensor parallelism {tp} and the "
                                 f"model's {num_key_value_heads} KV heads: one must divide the other")


@dataclass(frozen=True)
class KVLink:
    """A link between devices: what a KV cache moves over (between the sides) and what tensor parallelism's
    all-reduces use (inside an instance). `bandwidth`: bytes/s one way; `latency_s`: per transfer (assumed)."""

    name: str
    bandwidth: float
    latency_s: float
    source: str

    def transfer_time(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth


# One-way bandwidths from the vendors' published figures; the latencies are assumptions (a few microseconds
# on NVLink, ten on PCIe, tens on a network), small against any iteration here.
KV_LINKS = {
    "nvlink": KVLink("nvlink", 300e9, 5e-6,
                     "NVLink 3 (A100, the GPU of the Sarathi-Serve and DistServe papers): 600 GB/s both directions "
                     "together per GPU, NVIDIA A100 datasheet; 300 GB/s one way"),
    "pcie": KVLink("pcie", 32e9, 10e-6,
                   "PCIe 4.0 x16: 16 GT/s x 16 lanes with 128b/130b coding, about 31.5 GB/s one way (PCI-SIG); 32"),
    "25gbe": KVLink("25gbe", 25e9 / 8, 50e-6,
                    "25 Gbit/s Ethernet, DistServe's cross-node link (OSDI'24, section 6.1): 3.125 GB/s"),
}


def parse_kv_link(text: str) -> KVLink:
    """A preset name (nvlink, pcie, 25gbe) or a bandwidth in GB/s (10^9 bytes/s, one way)."""
    if text in KV_LINKS:
        return KV_LINKS[text]
    try:
        gbps = float(text)
    except ValueError:
        gbps = math.nan
    if not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"kv link must be one of {', '.join(KV_LINKS)} or a bandwidth in GB/s (> 0), got {text!r}")
    return KVLink(f"{gbps:g}GB/s", gbps * 1e9, 0.0, "given on the command line")
