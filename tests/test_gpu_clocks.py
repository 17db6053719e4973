"""scripts/gpu_clocks.py: the clock log joined to the bench records by their timed spans."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_clocks  # noqa: E402

LOG = """timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active
2026/12/02 16:00:00.000, 1980 MHz, 300.00 W, 40, 0x0000000000000000
2026/12/02 16:00:00.100, 1980 MHz, 690.50 W, 45, 0x0000000000000000
2026/12/02 16:00:00.200, 1755 MHz, 699.90 W, 50, 0x0000000000000004
2026/12/02 16:00:00.300, 1650 MHz, 700.10 W, 51, 0x0000000000000084
2026/12/02 16:00:00.400, 1980 MHz, 120.00 W, 40, 0x0000000000000001
2026/12/02 16:00:00.5"""


def _t(sec):  # epoch seconds of 2026/12/02 16:00:00 + sec, UTC
    return 1796227200.0 + sec


def test_each_record_gets_the_samples_of_its_span(tmp_path):
    log = tmp_path / "gpu-clocks.csv"
    log.write_text(LOG)
    samples = gpu_clocks.read_samples(str(log))
    assert len(samples) == 5  # the header and the cut last line are skipped
    assert samples[0][0] == _t(0.0) and samples[3][1:] == (1650.0, 700.1, 0x84)
    recs = [dict(impl="tabby-fp8", shape="kimi-k2", **{"pass": "fwd"}, ms=15.0, ms_min=13.0, t_start=_t(0.05),
                 t_end=_t(0.35)),
            dict(impl="tabby", shape="kimi-k2", **{"pass": "fwd"}, ms=22.0, ms_min=21.0, t_start=_t(0.35),
                 t_end=_t(0.45)),
            dict(impl="tabby", shape="glm-5", **{"pass": "fwd"}, ms=None, ms_min=None)]  # never timed
    rows = gpu_clocks.per_record(samples, recs)
    assert len(rows) == 2
    fp8, bf16 = rows
    assert fp8["samples"] == 3 and fp8["mhz_median"] == 1755 and fp8["mhz_min"] == 1650
    assert fp8["w_max"] == 700.1 and fp8["reasons"] == ["sw power cap", "hw power brake"]
    assert bf16["samples"] == 1 and bf16["reasons"] == ["idle"]
    out = tmp_path / "r.json"
    out.write_text(json.dumps(dict(records=recs)))
    part = tmp_path / "r.jsonl"
    part.write_text(json.dumps(dict(config=1)) + "\n" + "\n".join(json.dumps(r) for r in recs[:1]) + "\n")
    for res in (out, part):
        text = subprocess.run([sys.executable, "scripts/gpu_clocks.py", str(log), str(res)], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        assert "| kimi-k2 | tabby-fp8 | fwd | 15.00 / 13.00 | 3 | 1755 / 1650 | 700 / 700 | sw power cap, hw power brake |" \
            in text, text


def test_unknown_bits_are_named_by_value():
    assert gpu_clocks.reasons(0x4 | 0x1000) == ["sw power cap", "0x1000"]
    assert gpu_clocks.reasons(0) == []
