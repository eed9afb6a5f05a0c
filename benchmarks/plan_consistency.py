"""The planner's one-stage costs beside the whole-model programs its scales were measured on, part by part.

    PYTHONPATH=. python benchmarks/plan_consistency.py --calibrate /tmp/cal.json [--compiler fx] [--tiny]

A calibration's backward scale is the whole model's fused backward program over its ops' (and accumulations')
calibrated sum, so a one-stage plan of that model should cost its backward at the measured program's seconds.
This prints both sides and what makes each up: the fused backward's ops and accumulations, the planner's B and W
graphs' ops (and any the table lacks: those are costed by the roofline) and its accumulations.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
import ir  # noqa: E402
from engine.planning.artifacts import autodiff  # noqa: E402
from engine.planning.calibration import Calibration, accumulate_signature, ops_sums, signature  # noqa: E402
from engine.planning.devices import get_device, get_link  # noqa: E402
from engine.planning.op_costs import CostModel  # noqa: E402
from engine.planning.stage_costs import exact  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", required=True)
    ap.add_argument("--compiler", default="fx")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    net = build("resnet101x4" if cuda else "resnet50x1", classes=1000 if cuda else 10, base=64 if cuda else 8)
    net = net.to(dtype=dtype).train(True)
    fn, variables = engine.functionalize(net, loss=F.cross_entropy)
    size = 224 if cuda else 32
    x = torch.randn(16, 3, size, size).to(dtype)
    y = torch.randint(0, 10, (16,))
    step = engine.parallelize(fn, variables, x, y, schedule="1f1b", microbatches=1, has_aux=True,
                              calibrate=args.calibrate, compiler=args.compiler, min_microbatch_size=1)
    g, plan = step.graph, step.plan
    cal = Calibration.from_json(Path(args.calibrate).read_text()).for_compiler(args.compiler)
    profile = get_device(plan.device)
    model = CostModel(profile, get_link(None, profile), cal)
    first = plan.stages[0]
    planned_bw = first.backward_input_time + first.backward_weight_time
    print(f"plan ({plan.num_stages} stage, recompute {plan.recompute}, cheap {plan.remat}): F "
          f"{first.forward_time * 1e3:.3f} ms, B+W {planned_bw * 1e3:.3f} ms")
    print(f"scales: forward {cal.scale:.4f}, backward {cal.backward_scale:.4f}")
    for level in (False, "cheap"):
        ad = autodiff(ir.split(g, [])[0], level, device=str(device))
        sums = ops_sums(ad, g, cal)
        grad_avals = [g.inputs[sums.param_grads[ad.backward.out_slots[k]]].aval for k in sums.accumulate]
        acc_whole = sum(cal.times.get(accumulate_signature(a), 0.0) for a in grad_avals)
        st = exact(g, [], model, device=str(device), recompute=[level])[0]
        b_ops = model.graph_time(ad.backward_input.graph, backward=True)
        w_ops = model.graph_time(ad.backward_weight.graph, backward=True)
        acc_plan = model.params_accumulate_time(g, list(range(g.num_params)))
        bs = cal.backward_scale or cal.scale
        print(f"\nlevel {level}: whole fused backward {sums.backward * bs * 1e3:.3f} ms at the scale "
              f"(ops {(sums.backward - acc_whole) * bs * 1e3:.3f} + accumulations {acc_whole * bs * 1e3:.3f} over "
              f"{len(sums.accumulate)} grads); planner B+W {(st.backward_input + st.backward_weight) * 1e3:.3f} ms "
              f"(B ops {b_ops * 1e3:.3f}, W ops {w_ops * 1e3:.3f}, accumulations {acc_plan * 1e3:.3f}); "
              f"forward whole {sums.forward * cal.scale * 1e3:.3f}, planner {st.forward * 1e3:.3f}")
        fused = Counter(e.op for e in ad.backward.graph.eqns if signature(e) in cal.times)
        split = Counter(e.op for e in (*ad.backward_input.graph.eqns, *ad.backward_weight.graph.eqns)
                        if signature(e) in cal.times)
        missing = [e for e in (*ad.backward_input.graph.eqns, *ad.backward_weight.graph.eqns)
                   if signature(e) not in cal.times and model.eqn_time(e) > 0]
        guessed = sum(model.eqn_time(e, backward=True) for e in missing)
        print(f"  ops the table lacks in B/W: {len(missing)} ({guessed * 1e3:.3f} ms by roofline): "
              f"{Counter(e.op for e in missing).most_common(6)}")
        diff = {op: (fused[op], split[op]) for op in set(fused) | set(split) if fused[op] != split[op]}
        print(f"  ops counted differently (fused, B+W): {sorted(diff.items())[:12]}")
        tf: dict[str, float] = {}
        for e in ad.backward.graph.eqns:
            tf[e.op] = tf.get(e.op, 0.0) + cal.times.get(signature(e), 0.0)
        for e in (*ad.backward_input.graph.eqns, *ad.backward_weight.graph.eqns):
            tf[e.op] = tf.get(e.op, 0.0) - cal.times.get(signature(e), 0.0)
        big = sorted(tf.items(), key=lambda kv: -abs(kv[1]))[:8]
        print("  calibrated ms, fused minus B+W, by op: " + ", ".join(f"{op} {t * bs * 1e3:+.3f}" for op, t in big))
    step.close()


if __name__ == "__main__":
    main()
