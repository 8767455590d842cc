"""docs/figures/make.py draws the course's figures from real runs, with no network: every
figure it lists is on a page, the drawn ones come out as small PNGs (`--out`, leaving the
committed ones alone), and what the chapter 11 and 12 figures show is checked here against
the algorithm: whose contributions each rank's chunks hold after each step of the
hierarchical all-reduce, and which rows or columns of the whole weights each tensor-parallel
rank holds, with the collectives the layers issued."""

import importlib.util
import sys
from pathlib import Path

import pytest

import microddp as mdp

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"


def _load(name: str):
    """A module of docs/figures, imported by its own name as make.py imports it, so that the
    ranks it spawns find their functions (spawn sends them by name, with this sys.path)."""
    if str(FIGURES) not in sys.path:
        sys.path.insert(0, str(FIGURES))
    if name == "make":  # not a name to leave in sys.modules; nothing of it goes to a rank
        spec = importlib.util.spec_from_file_location("docs_figures_make", FIGURES / "make.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


def test_every_listed_figure_has_a_png_and_a_drawing_function():
    make = _load("make")
    names = [*make.COMMANDS, *make.DRAWN]
    assert {"ladder", "ddp-buckets", "hierarchy", "tp-split"} <= set(names)
    assert len(names) == len(set(names))
    for name in names:
        assert (FIGURES / f"{name}.png").is_file(), name
    for module, function in make.DRAWN_BY.values():
        assert callable(getattr(_load(module), function)), (module, function)
    shown = "".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for name in ("ladder", "ddp-buckets", "hierarchy", "tp-split"):
        assert f"(figures/{name}.png)" in shown, f"{name}.png is on no page"


def test_hierarchy_figure_states_follow_the_three_steps():
    draw = _load("draw_parallel")
    ranks = mdp.spawn(draw._hierarchy_rank, 4, timeout=240)
    a, b, c, d = 1, 2, 4, 8  # rank r contributes 2 ** r
    assert [r["states"][0] for r in ranks] == [[a, a], [b, b], [c, c], [d, d]]
    # 1. inside each host, local rank j keeps the host's sum of chunk j
    assert [r["states"][1] for r in ranks] == [[a + b, 0], [0, a + b], [c + d, 0], [0, c + d]]
    # 2. along the rails (ranks 0 and 2, 1 and 3) the chunk becomes the sum of all four
    full = a + b + c + d
    assert [r["states"][2] for r in ranks] == [[full, 0], [0, full], [full, 0], [0, full]]
    assert [r["states"][3] for r in ranks] == [[full, full]] * 4
    assert all(r["same"] for r in ranks)  # equal to hierarchical_all_reduce and the ring
    # bytes between the hosts for 4 MiB: the flat ring's two crossing ranks send 2(p-1)/p of
    # it each; on a rail each rank sends 2(h-1)/h of its 2 MiB chunk
    mib = 1 << 20
    assert [r["flat"] for r in ranks] == [0, 6 * mib, 0, 6 * mib]
    assert [r["hierarchical"] for r in ranks] == [2 * mib] * 4


def test_tp_split_figure_shards_and_collectives():
    draw = _load("draw_parallel")
    d, t = draw.D, draw.T
    ranks = mdp.spawn(draw._tp_rank, 2, timeout=240)
    for r, got in enumerate(ranks):
        assert got["same"]
        assert got["up"] == ((2 * d, d), (2 * d * r, 2 * d * (r + 1)))  # rows of (4d, d)
        assert got["down"] == ((d, 2 * d), (2 * d * r, 2 * d * (r + 1)))  # columns of (d, 4d)
        # forward: the row layer's partial sums; backward: X's gradient at the column layer
        assert got["calls"] == [("all_reduce", t * d * 4, "forward"),
                                ("all_reduce", t * d * 4, "backward")]


def test_make_draws_a_figure_elsewhere(tmp_path):
    make = _load("make")
    before = (FIGURES / "figures.json").read_text()
    assert make.main(["--out", str(tmp_path), "tp-split"]) == 0
    for name in ("tp-split",):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 0 < png.stat().st_size < make.MAX_BYTES
    assert (FIGURES / "figures.json").read_text() == before  # a trial leaves the docs alone


@pytest.mark.slow  # traced runs of 2 ranks (a minute or two on a loaded 2-core host)
def test_make_draws_the_chapter_5_and_11_figures(tmp_path):
    make = _load("make")
    assert make.main(["--out", str(tmp_path), "ladder", "ddp-buckets", "hierarchy"]) == 0
    for name in ("ladder", "ddp-buckets", "hierarchy"):
        assert 0 < (tmp_path / f"{name}.png").stat().st_size < make.MAX_BYTES


@pytest.mark.slow
def test_ladder_figure_traces_every_stage_and_ddp_buckets_fill_in_backward_order():
    draw = _load("draw_dp")
    ladder = mdp.spawn(draw._ladder_rank, 2, timeout=600)[0]
    assert list(ladder) == list(draw.LADDER)
    for engine, got in ladder.items():
        tracks = {track for _, track, _, _ in got["spans"]}
        assert {"compute", "comm"} <= tracks, engine
        assert got["stats"]["comm_s"] > 0, engine
        if engine != "overlap":  # a blocking stage hides none of its communication
            assert got["stats"]["exposed_comm_s"] == pytest.approx(got["stats"]["comm_s"])
    ddp = mdp.spawn(draw._ddp_rank, 2, timeout=300)[0]
    order = sorted(ddp["fired"], key=ddp["fired"].get)
    bucket_of = {i: k for k, idx in enumerate(ddp["buckets"]) for i in idx}
    assert order[0] in (len(ddp["names"]) - 1, len(ddp["names"]) - 2)  # the last layer first
    assert [bucket_of[i] for i in order] == sorted(bucket_of[i] for i in order)  # filled in turn
    launched = sorted(ddp["comm"], key=lambda c: c[1])
    assert [k for k, _, _ in launched] == list(range(len(ddp["buckets"])))  # started in order
