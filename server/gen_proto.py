"""Regenerate the committed protobuf / gRPC modules: `python -m server.gen_proto` from the repository root.

The proto is compiled with the repository root as the include path, so the generated modules import each
other as `server.proto.sarathi.v1.generation_pb2` and work wherever the repository root is on sys.path.
"""

from __future__ import annotations

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ["server/proto/sarathi/v1/generation.proto"]


def main(out_dir: str | pathlib.Path | None = None) -> int:
    """Compile PROTOS into `out_dir` (default: the repository root, i.e. next to the .proto files)."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError("regenerating the proto modules needs grpcio-tools, the proto extra: "
                          "pip install 'sarathi-jax[proto]'") from e

    out = pathlib.Path(out_dir) if out_dir is not None else REPO_ROOT
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(REPO_ROOT / proto),
        ]
        rc = protoc.main(args)
        if rc != 0:
            print(f"protoc failed on {proto} (exit {rc})", file=sys.stderr)
            return rc
        print(f"generated {proto}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
