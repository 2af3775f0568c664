"""Device inputs and the streams their producers wrote them on (no GPU needed: fake arrays)."""
import types

import numpy as np
import pytest

from pyhipa2a.inputs import device_view, producer_stream


class CAIArray:
    def __init__(self, stream="absent"):
        self.__cuda_array_interface__ = {"shape": (2, 4), "typestr": "<f2", "data": (0, False), "version": 3}
        if stream != "absent":
            self.__cuda_array_interface__["stream"] = stream


class Stop(Exception):
    pass


class DLPackArray:
    """Records the stream __dlpack__ was asked for, then stops (no capsule is needed to check that)."""

    def __init__(self):
        self.asked = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.asked.append(stream)
        raise Stop


FAKE_CUDA = types.SimpleNamespace(kind="cuda", dlpack_device_type=2, pointer_device=lambda ptr: 0)


def test_producer_stream_as_the_interface_names_it():
    assert producer_stream(CAIArray()) is None                  # v2 arrays: no stream, nothing to wait for
    assert producer_stream(CAIArray(None)) is None              # "no synchronization needed"
    assert producer_stream(CAIArray(1)) == 1                    # the legacy default stream
    assert producer_stream(CAIArray(0x7F00_1234)) == 0x7F00_1234
    for bad in ("7", True, -1, 0, 1.5):  # 0 is ambiguous: version 3 forbids it
        with pytest.raises(ValueError, match="stream must be None or a stream handle"):
            producer_stream(CAIArray(bad))


def test_cai_inputs_are_marked_for_a_wait_at_each_use():
    view = device_view(CAIArray(5), FAKE_CUDA, 0, "x")
    assert view.cai and view.shape == (2, 4) and view.dtype == np.float16


def test_dlpack_export_names_the_reading_stream():
    arr = DLPackArray()
    with pytest.raises(Stop):
        device_view(arr, FAKE_CUDA, 0, "x", dlpack_stream=0x5000)
    assert arr.asked == [0x5000]


def test_expert_scale_is_checked_as_the_float32_the_kernels_use():
    from pyhipa2a.inputs import check_scale
    assert check_scale(1.0) == 1.0 and check_scale(2) == 2.0 and check_scale(np.float16(1.5)) == 1.5
    assert check_scale(0) == 0.0 and check_scale(-3.25) == -3.25
    assert check_scale(0.1) == float(np.float32(0.1))  # what the kernel multiplies by
    for bad in (True, np.bool_(False), "2", None, 1j, np.array([1.0])):
        with pytest.raises(TypeError, match="expert_scale must be a real number"):
            check_scale(bad)
    for bad in (float("nan"), float("inf"), -1e39, 10**400):
        with pytest.raises(ValueError, match="is not a finite float32"):
            check_scale(bad)
    with pytest.raises(ValueError, match="too small for float32"):
        check_scale(1e-46)
