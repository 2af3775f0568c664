"""The traffic model that bench.py's link bandwidth and speed of light rest on."""
import numpy as np

from pyhipa2a.traffic import link_bytes


def test_two_ranks_by_hand():
    # E=4 over 2 ranks (experts 0,1 on rank 0; 2,3 on rank 1), k=2, H=8, fp16.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)   # rank 0's 3 tokens
    idx1 = np.array([[1, 3]], np.int32)                   # rank 1's 1 token
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8)
    # Headers and weights travel as 8-byte tagged words (value and epoch).
    # rank 0: header of 3*2 entries, the count and its count for each of rank 1's 2 experts; tokens 1 and 2 go to
    # rank 1 once each (token 2 has two experts there)
    assert dispatch[0] == (3 * 2 + 1 + 2) * 8 + 2 * 8 * 2
    # rank 1: header of 1*2 entries, the count and 2 expert counts; its token goes to rank 0 once
    assert dispatch[1] == (1 * 2 + 1 + 2) * 8 + 1 * 8 * 2
    # combine: weights to the peer; rank 1 returns a raw row for token 1 of rank 0 and an
    # fp32 partial for token 2 (two experts there); rank 0 returns a raw row for rank 1's token
    assert combine[0] == 3 * 2 * 8 + 1 * 8 * 2
    assert combine[1] == 1 * 2 * 8 + 8 * 2 + 8 * 4


def test_pushed_calls_double_their_data():
    # The same routing; rank 1 (1 token) pushes, rank 0 (3 tokens) stages. A pushed call's tokens and
    # the contributions to them cross as tagged words: 4 data bytes in 8. Headers and weights as before.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[1, 3]], np.int32)
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, push_max_tokens=1)
    assert dispatch[0] == (3 * 2 + 1 + 2) * 8 + 2 * 8 * 2              # staged, as in the test above
    assert dispatch[1] == (1 * 2 + 1 + 2) * 8 + 2 * (1 * 8 * 2)        # pushed: its token doubled
    assert combine[0] == 3 * 2 * 8 + 2 * (1 * 8 * 2)               # rank 0's raw row for rank 1's token
    assert combine[1] == 1 * 2 * 8 + 8 * 2 + 8 * 4                 # for rank 0's staged tokens, as above


def test_pushed_calls_that_pull_their_tokens():
    # As above, but the pushed call pulls its tokens (push_tokens=False: flags after a GPU-scope
    # fence): only the contributions to its token cross as tagged words.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[1, 3]], np.int32)
    pushing = link_bytes([idx0, idx1], num_experts=4, hidden=8, push_max_tokens=1)
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, push_max_tokens=1, push_tokens=False)
    assert dispatch[0] == pushing[0][0]
    assert dispatch[1] == (1 * 2 + 1 + 2) * 8 + 1 * 8 * 2              # its token once, as staged
    assert (combine == pushing[1]).all()                            # contributions still pushed back


def test_narrow_partials_halve_the_partial_sums():
    # The same routing and calls as the first test. A rank hosting several of a token's experts
    # sends its partial sum in the output's format (2 bytes an element here), not fp32; raw rows,
    # headers and weights are unchanged.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[1, 3]], np.int32)
    wide = link_bytes([idx0, idx1], num_experts=4, hidden=8)
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, narrow_partials=True)
    assert np.array_equal(dispatch, wide[0])
    assert combine[0] == wide[1][0]                                # rank 0 returns a raw row only
    assert combine[1] == 1 * 2 * 8 + 8 * 2 + 8 * 2                 # token 2's partial: 8 elements x 2 bytes


def test_pushed_narrow_partials():
    # Rank 1's one token has both its experts on rank 0 and rank 1 pushes (push_max_tokens=1): rank 0's
    # partial sum for it crosses as tagged words, 8 elements of 4 bytes (fp32) or 2 (narrow), doubled.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[0, 1]], np.int32)
    for narrow, itemsize in ((False, 4), (True, 2)):
        _, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, push_max_tokens=1, narrow_partials=narrow)
        assert combine[0] == 3 * 2 * 8 + 2 * (8 * itemsize)          # weights, then the pushed partial


def test_each_route_chunk_sends_its_counts():
    # The first test's routing; a source sends its count for each of the peer's experts once per route
    # chunk of the call (kernels.route_chunks: chunks of max_tokens), here 3: two more words per chunk.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[1, 3]], np.int32)
    one = link_bytes([idx0, idx1], num_experts=4, hidden=8)
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, count_chunks=3)
    assert np.array_equal(dispatch - one[0], [2 * 2 * 8, 2 * 2 * 8]) and np.array_equal(combine, one[1])


def test_weights_given_to_dispatch_go_to_their_experts_ranks():
    # The first test's routing with the weights given to dispatch: each slot's weight crosses once, to
    # the rank of its expert, with dispatch (rank 0: slots (1, 1), (2, 0), (2, 1) live on rank 1;
    # rank 1: slot (0, 0) on rank 0); combine sends no weights.
    idx0 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
    idx1 = np.array([[1, 3]], np.int32)
    at_combine = link_bytes([idx0, idx1], num_experts=4, hidden=8)
    dispatch, combine = link_bytes([idx0, idx1], num_experts=4, hidden=8, weights_at="dispatch")
    assert np.array_equal(dispatch - at_combine[0], [3 * 8, 1 * 8])
    assert np.array_equal(at_combine[1] - combine, [3 * 2 * 8, 1 * 2 * 8])
