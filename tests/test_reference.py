"""The oracle itself, where it states more than a loop over the contract: narrow partials."""
import numpy as np

from pyhipa2a import reference
from pyhipa2a.testing import UNIT_ROUNDOFF, draw_world

ULP = 2.0 ** -10  # fp16's ulp in [1, 2)


def test_narrow_partials_by_hand():
    # E=4 over 2 ranks (experts 0,1 on rank 0; 2,3 on rank 1), k=2, H=1, fp16, the fake expert x * (1 + rank).
    x = [np.array([[1 + ULP]], np.float16), np.array([[1 + ULP]], np.float16)]
    # Rank 0's token goes to experts 2 and 3, both on rank 1: a partial sum that crosses.
    # Rank 1's token goes to its own experts 2 and 3: the owner's part, never rounded.
    idx = [np.array([[2, 3]], np.int32), np.array([[2, 3]], np.int32)]
    w = [np.array([[0.5, 0.25]], np.float32), np.array([[0.5, 0.25]], np.float32)]
    # Rank 1's rows are x * 2 = 2 + 2 ulp (exact), so p = 0.75 * (2 + 2 ulp) = 1.5 + 1.5 ulp: halfway
    # between two fp16 values, rounded to the even one, 1.5 + 2 ulp.
    wide = reference.combine(x, idx, w, 4)
    narrow = reference.combine(x, idx, w, 4, partials_dtype=np.float16)
    slack = reference.narrow_partials_slack(x, idx, w, 4, UNIT_ROUNDOFF["float16"])
    assert wide[0][0, 0] == 1.5 + 1.5 * ULP
    assert narrow[0][0, 0] == 1.5 + 2 * ULP
    assert slack[0][0, 0] == 2.0 ** -11 * (1.5 + 1.5 * ULP)
    assert narrow[1][0, 0] == wide[1][0, 0] == 1.5 + 1.5 * ULP and slack[1][0, 0] == 0


def test_single_rows_and_the_owners_part_are_not_rounded():
    # Rank 0's token: expert 0 (its own) and expert 2 (alone on rank 1): nothing crosses as a sum.
    x = [np.array([[1 + ULP]], np.float16), np.zeros((0, 1), np.float16)]
    idx = [np.array([[0, 2]], np.int32), np.zeros((0, 2), np.int32)]
    w = [np.array([[0.3, 0.7]], np.float32), np.zeros((0, 2), np.float32)]
    wide = reference.combine(x, idx, w, 4)
    assert np.array_equal(reference.combine(x, idx, w, 4, partials_dtype=np.float16)[0], wide[0])
    assert not reference.narrow_partials_slack(x, idx, w, 4, UNIT_ROUNDOFF["float16"])[0].any()


def test_slack_bounds_the_narrow_contract_and_is_tight():
    """On random inputs (signed weights, so parts cancel): the narrow oracle stays within the slack of
    the fp32 one everywhere, and somewhere uses most of it (the bound is not loose)."""
    for dtype in ("float16", "bfloat16"):
        world, E = 4, 16
        inputs = draw_world(7, world, E, 4, 64, 24, dtype, exact=True)
        wide = reference.combine(inputs.xs, inputs.indices, inputs.weights, E)
        narrow = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, partials_dtype=inputs.xs[0].dtype)
        slack = reference.narrow_partials_slack(inputs.xs, inputs.indices, inputs.weights, E, UNIT_ROUNDOFF[dtype])
        used = 0.0
        for r in range(world):
            moved = np.abs(narrow[r] - wide[r])
            assert np.all(moved <= slack[r]), dtype
            used = max(used, float(np.max(moved / np.where(slack[r] > 0, slack[r], 1.0))))
        assert used > 0.9, (dtype, used)


def test_exact_inputs_keep_fp32_sums_exact():
    """draw_world(exact=True)'s promise: at 8 ranks and top-8, every part and every sum of parts fits
    fp32's 24 bits, so the float64 oracle and any fp32 summation order agree exactly."""
    world, E, k = 8, 64, 8
    inputs = draw_world(3, world, E, k, 128, 16, "float16", exact=True)
    for src in range(world):
        for t in range(len(inputs.xs[src])):
            total = np.zeros(128, np.float32)
            for _, _, part in reference.parts_by_rank(inputs.xs, inputs.indices, inputs.weights, E, src, t):
                assert np.array_equal(part.astype(np.float32).astype(np.float64), part)
                total += part.astype(np.float32)
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[src])[src][t]
            assert np.array_equal(total.astype(np.float64), expected)
