"""The what-if report's text: a comparison that changes the chip count says so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tokenhaul.whatif import report
from tokenhaul.whatif.hardware import load_hardware
from tokenhaul.whatif.modelspec import load_model_config
from tokenhaul.whatif.workload import Workload, predict

LLAMA_70B = Path(__file__).with_name("llama-3-70b-config.json")


def workload(**kw) -> Workload:
    name, cfg = load_model_config(str(LLAMA_70B))
    return Workload(name, cfg, **({"batch": 8, "context": 4096, "quantization": "int8"} | kw))


def test_a_comparison_on_more_chips_names_them():
    """groq-lpu takes as many chips as the weights and KV need: context ×8 reads faster per user than the base
    (README's example, 376 → 718 chips), and the text gives the chips it runs on; where the count stays (h100:
    one chip), none is named."""
    w, groq = workload(), load_hardware("groq-lpu")
    p = predict(w, groq)
    long, wide = (predict(replace(w, **kw), groq) for kw in ({"context": w.context * 8}, {"batch": w.batch * 8}))
    assert long.chips > p.chips and long.decode_tokens_per_s > p.decode_tokens_per_s
    ans = dict(report.questions(p))
    modes = next(a for q, a in ans.items() if q.startswith("Under which mode"))
    assert f"context ×8 (32768): {long.decode_tokens_per_s:.3g} tok/s/user" in modes
    assert f"on {long.chips} chips, not {p.chips}" in modes.split("batch ×8")[0]
    assert (f"on {wide.chips} chips, not {p.chips}" in modes.split("batch ×8")[1]) == (wide.chips != p.chips)
    steady = next(a for q, a in ans.items() if q.startswith("What is the steady cost"))
    both = predict(replace(w, context=w.context * 8, batch=w.batch * 8), groq)
    assert f"(batch 64, context 32768, on {both.chips} chips, not {p.chips})" in steady
    small = workload(context=2048)
    h100 = predict(small, load_hardware("h100"))
    text = report.text([h100, predict(small, groq)])
    assert "chips, not" not in text.split("groq-lpu: ")[0]  # h100's part: one chip throughout
    assert f"vs h100 (1 chip → {predict(small, groq).chips} chips): TPOT" in text
