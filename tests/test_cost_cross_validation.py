"""bench/cost_accuracy.py --cross-validate: every row is predicted by a fit that never saw its model.

Synthetic rows (two GPT sizes on A100 nodes; times made up here, not measured data) go through the
bench's leave-one-size-out function with one sweep per refit: each fold's fit excludes the held-out
size, and the table reports in-sample and out-of-sample errors with their signs.
"""

from __future__ import annotations

from pathlib import Path

from cost_models.calibration import default_calibration
from cost_models.measured import read_measured

HEADER = "params_b,gpus,global_batch,micro_batch,hidden_size,num_attention_heads,num_hidden_layers,seq_len,tp,dp,pp,iteration_ms\n"
ROWS = [  # two sizes, two layouts each
    "1.3,8,64,2,2048,16,24,2048,1,8,1,{t}", "1.3,8,64,2,2048,16,24,2048,1,4,2,{t}",
    "2.7,8,64,2,2560,32,32,2048,1,8,1,{t}", "2.7,8,64,1,2560,32,32,2048,2,4,1,{t}",
]


def test_leave_one_size_out_predicts_every_row_from_a_fit_without_its_size(bench, tmp_path: Path, monkeypatch,
                                                                           capsys) -> None:  # noqa: ANN001
    cal = default_calibration("a100-80gb")
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n".join(r.format(t=1000.0) for r in ROWS) + "\n")
    runs = read_measured(path)
    # "measured" = 1.3x the shipped model's prediction, so a refit has something to learn
    times = [1300.0 * t for t in bench.predict(runs, cal, bench.VTRAIN)]
    path.write_text(HEADER + "\n".join(r.format(t=f"{t:.3f}") for r, t in zip(ROWS, times)) + "\n")
    runs = read_measured(path)
    seen: list[set[str]] = []
    fit = bench.fit

    def recording(groups, start, setup, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append({r.label for g in groups for r in g})
        return fit(groups, start, setup, **kw)

    monkeypatch.setattr(bench, "fit", recording)
    bench.cross_validate({"runs.csv": runs}, cal, bench.VTRAIN, sweeps=1)
    out = capsys.readouterr().out
    assert seen == [{"2.7B"}, {"1.3B"}]  # each fold fitted without the size it then predicts
    row = next(line for line in out.splitlines() if line.strip().startswith("runs.csv"))
    in_mape, in_signed, out_mape, out_signed = (float(x.rstrip("%")) for x in row.split()[2:6])
    assert in_signed < 0 and abs(in_mape + in_signed) < 0.011  # the shipped fit is 1.3x short on every row
    assert out_mape < in_mape  # a refit on the other size learns most of the 1.3x
