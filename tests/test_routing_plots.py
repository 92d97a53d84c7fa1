"""Routing-eval plots (trl_ext/routing/plots.py) from hand-written routing_eval.jsonl files."""

import json

import pytest

from trl_ext.routing.plots import curves, main, plot_comparison, plot_modes


def write_run(d, rates):
    d.mkdir()
    with (d / "routing_eval.jsonl").open("w") as f:
        for step, (b, r, fo) in zip((10, 20), rates):
            modes = {"both": {"rh_rate": b}, "retain_only": {"rh_rate": r}, "forget_only": {"rh_rate": fo}}
            f.write(json.dumps({"step": step, "modes": modes}) + "\n")
    return d


def test_curves_and_plots(tmp_path):
    a = write_run(tmp_path / "a", [(0.5, 0.1, 0.9), (0.6, 0.0, 1.0)])
    b = write_run(tmp_path / "b", [(0.2, 0.2, 0.2), (0.3, 0.3, 0.3)])
    from trl_ext.routing.evaluation import read_records

    c = curves(read_records(a), "rh_rate")
    assert c == {"both": ([10, 20], [0.5, 0.6]), "retain_only": ([10, 20], [0.1, 0.0]),
                 "forget_only": ([10, 20], [0.9, 1.0])}
    with pytest.raises(KeyError, match="no 'reward/x'"):
        curves(read_records(a), "reward/x")
    png = plot_modes(a, tmp_path / "a.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot_comparison({"routed s1": a, "plain s1": b}, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(a)]) == 0 and (a / "routing_eval.png").is_file()
    assert main([str(a), str(b)]) == 2  # several runs need --out
    assert main([str(a), str(b), "--out", str(tmp_path / "d.png")]) == 0 and (tmp_path / "d.png").is_file()
    assert main([str(tmp_path)]) == 2  # no routing_eval.jsonl
