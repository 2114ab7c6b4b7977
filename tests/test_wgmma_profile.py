"""The wgmma profile's byte count (benchmarks/wgmma_profile.py): what a launch configuration moves, checked on a
7B shape by hand, and the shapes argument's errors."""

import pytest

from benchmarks import wgmma_profile as wp
from qerl.kernels import cuda_fp4 as cf


def test_traffic_counts_weights_once_per_token_tile_and_tokens_once_per_row_block():
    n, k = 37888, 3584  # 7B gate|up: 2368 strips of 16 rows, 56 chunks of 64 k
    t = wp.traffic("nvfp4", n, k, 128, (16, 0, 2, 2))  # 128 tokens per CTA, 2 warpgroups (128 rows), 2 K groups
    assert t["weight_bytes"] == 2368 * 56 * (512 + 64)  # one token tile: every packed word and scale pair once
    assert t["token_bytes"] == (37888 // 128) * 128 * 3584 * 2  # 296 row blocks each stage all 128 tokens x K
    assert t["splitk_bytes"] == 0 and t["flops"] == 2 * 128 * n * k and t["ctas"] == 296 and t["threads"] == 512
    # one warpgroup along the rows (64 rows per CTA) doubles the token re-reads; half the tokens per CTA double the
    # weight reads
    assert wp.traffic("nvfp4", n, k, 128, (16, 0, 1, 2))["token_bytes"] == 2 * t["token_bytes"]
    assert wp.traffic("nvfp4", n, k, 128, (8, 0, 2, 2))["weight_bytes"] == 2 * t["weight_bytes"]
    # MXFP4 stages half the scale bytes; a partial token tile reads only the rows that exist
    assert wp.traffic("mxfp4", n, k, 100, (16, 0, 2, 2))["weight_bytes"] == 2368 * 56 * (512 + 32)
    assert wp.traffic("nvfp4", n, k, 100, (16, 0, 2, 2))["token_bytes"] == 296 * 100 * 3584 * 2
    # CTA splits of K write and read fp32 partial tiles: kz x tiles x (tokens x rows) x 4 B, twice
    tz = wp.traffic("nvfp4", 3584, 18944, 64, (8, -1, 1, 2))
    assert tz["splitk_bytes"] == 2 * 2 * 1 * 56 * 64 * 64 * 4 and tz["ctas"] == 112
    # stream-K on 132 CTAs x 2 groups: the same operand bytes as kz = 1; the shared tiles' partials counted from
    # the schedule (264 workers: 528 tiles whole, the other 64 x 56 units split)
    sk = (16, cf.WGMMA_SK, 1, 2)
    t = wp.traffic("nvfp4", n, k, 128, (16, 0, 1, 2))
    ts = wp.traffic("nvfp4", n, k, 128, sk, sk_ctas=132)
    assert (ts["weight_bytes"], ts["token_bytes"], ts["ctas"]) == (t["weight_bytes"], t["token_bytes"], 132)
    parts = sum(1 for seg in cf.streamk_segments(592, 56, 264) if seg[4] >= 0)  # 2 x 264 whole, 64 tiles split
    assert ts["splitk_bytes"] == 2 * parts * 128 * 64 * 4 and 64 <= parts <= 2 * 264
    with pytest.raises(ValueError, match="sk_ctas"):
        wp.traffic("nvfp4", n, k, 128, sk)
    with pytest.raises(ValueError, match="not a wgmma one"):
        wp.traffic("nvfp4", n, k, 128, (8, 1, 2, 1))


def test_shapes_argument():
    assert wp.parse_shapes("37888x3584,3584X18944") == [(37888, 3584), (3584, 18944)]
    for bad in ["37888", "100x3584", "3584x100", "axb"]:
        with pytest.raises(ValueError, match="--shapes entry"):
            wp.parse_shapes(bad)


def test_configs_argument():
    assert wp.parse_configs("16,0,2,2 8,-1,4,1;4,0,1,1") == [(16, 0, 2, 2), (8, -1, 4, 1), (4, 0, 1, 1)]
    assert wp.parse_configs("") == []
    assert wp.parse_configs(" tuned ") == wp.TUNED
    for bad in ["16,0,2", "8,1,2,1", "a,b,c,d", "tuned,16,0,2,2"]:
        with pytest.raises(ValueError, match="--configs entry"):
            wp.parse_configs(bad)


def test_lora_argument_refused_before_any_gpu_work():
    for bad in ("12", "-8"):
        with pytest.raises(ValueError, match="--lora"):
            wp.main(["--lora", bad, "--m", "128"])
