"""`tabby profile`: every stage of both passes is timed (CPU: wall clock under the interpreter)."""
import json

from tabby.cli import main


def test_profile_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "stages.json"
    assert main(["profile", "--shapes", "tiny", "--tokens", "8", "--iters", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    stages = rows[0]["stages_ms"]
    want = {"fwd:publish+wait", "fwd:schedule", "fwd:dispatch", "fwd:gate_up", "fwd:down+push",
            "fwd:signal+wait", "fwd:combine", "bwd:publish+wait", "bwd:dispatch_dy", "bwd:down_dgrad+swiglu",
            "bwd:gate_up_dgrad+push", "bwd:router_grad", "bwd:wgrad", "bwd:signal+wait", "bwd:combine"}
    assert set(stages) == want
    assert all(v > 0 for v in stages.values())
    assert "tiny T=8 EP1" in capsys.readouterr().out
