"""Plan time of RaNNC's flagship: `resnet152x8` (3.7 B params) for 32 ranks x 32 GB, batch 128 at 224x224.

    PYTHONPATH=. python benchmarks/plan_resnet.py [--model resnet152x8] [--world 32] [--batch 128]
                                                  [--mode train|eval] [--memory-gb 32] [--profile]

`plan_scale.py --target resnet152x8` under its old name (one runner and one ResNet builder,
examples/resnet_model.py, for every plan_*.py): built on the meta device, planned in one CPU process with
stages, dp and microbatches "auto"; prints the plan, the seconds, the peak RSS and a cProfile with
`--profile`. `--mode train` plans BatchNorm in train mode (its microbatch floor of 16 applies;
`--min-microbatch` lowers it).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_scale  # noqa: E402


def main() -> None:
    ap = plan_scale.parser(__doc__.splitlines()[0])
    ap.set_defaults(target="resnet152x8")
    plan_scale.run_target(ap.parse_args())


if __name__ == "__main__":
    main()
