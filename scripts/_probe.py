import cupy as cp
from pyhipa2a.runtime.cuda import CudaBackend
from cuda.bindings import driver as d
b = CudaBackend(); info = b.open_device(1)
with cp.cuda.Device(1):
    x = cp.zeros(16, cp.float16)
print("cupy device", x.device.id, "ptr", hex(x.data.ptr), "ours", b.pointer_device(x.data.ptr))
print("raw", d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, x.data.ptr))
p = b.malloc_ipc(1024); print("our alloc on dev1 ->", b.pointer_device(p))
