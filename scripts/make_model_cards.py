"""Regenerate MODEL_CARDS.md and the publishing table of docs/publishing.md.

They come from scripts/model_card_facts.json, with attnzoo.hub's generator (the one that writes
the Hub cards); with --measure, first measure the facts again: each model's GMACs and attnzoo
ops (on the meta device), and with --throughput its CPU inference img/s (torch backend, fp32).

    python scripts/make_model_cards.py
    python scripts/make_model_cards.py --measure [--models nat_mini ...] [--throughput]
                                       [--batch-size 4] [--steps 2]

tests/test_hub.py fails when either document differs from what this writes.
"""
import argparse
import datetime
import json
import platform
import re
import statistics
import sys
from pathlib import Path

import timm
import torch

import attnzoo
from attnzoo import hub
from attnzoo.profiling import model_step, time_steps

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "scripts" / "model_card_facts.json"
PUBLISHING = ROOT / "docs" / "publishing.md"
TABLE = re.compile(r"(<!-- publish table -->\n).*?(<!-- end publish table -->)", re.S)


def _img_per_s(name: str, batch_size: int, steps: int) -> float:
    model = timm.create_model(name).eval()
    x = torch.randn(batch_size, *model.pretrained_cfg["input_size"])
    with attnzoo.use_backend("torch"):
        seconds = statistics.median(time_steps(model_step(model, x), "cpu", warmup=1,
                                               repeats=steps))
    return batch_size / seconds


def measure(facts: dict, args) -> None:
    names = args.models or attnzoo.list_models()
    unknown = sorted(set(names) - set(attnzoo.list_models()))
    if unknown:
        sys.exit(f"--models: not attnzoo models: {', '.join(unknown)}")
    facts["models"] = {n: f for n, f in facts.get("models", {}).items()
                       if n in attnzoo.list_models()}
    if args.throughput:
        facts["throughput_setting"] = (
            f"batch {args.batch_size}, fp32, torch backend, {platform.machine()}, "
            f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}")
    for i, name in enumerate(names):
        print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
        entry = hub.measure_facts(timm.create_model(name, device="meta"))
        previous = facts["models"].get(name, {})
        entry["img_per_s"] = (round(_img_per_s(name, args.batch_size, args.steps), 2)
                              if args.throughput else previous.get("img_per_s"))
        facts["models"][name] = entry
    facts["models"] = dict(sorted(facts["models"].items()))
    facts["measured_on"] = str(datetime.date.today())
    FACTS.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"wrote {FACTS.relative_to(ROOT)}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the facts first")
    parser.add_argument("--models", nargs="*", default=None, help="with --measure: only these")
    parser.add_argument("--throughput", action="store_true", help="with --measure: also img/s")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    facts = json.loads(FACTS.read_text()) if FACTS.exists() else {}
    if args.measure:
        measure(facts, args)
    (ROOT / "MODEL_CARDS.md").write_text(hub.model_cards_markdown(facts))
    doc = PUBLISHING.read_text()
    if not TABLE.search(doc):
        sys.exit("docs/publishing.md has no <!-- publish table --> ... <!-- end publish table --> "
                 "block")
    PUBLISHING.write_text(TABLE.sub(lambda m: m.group(1) + hub.publish_table() + m.group(2), doc))
    print("wrote MODEL_CARDS.md and docs/publishing.md's publishing table", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
