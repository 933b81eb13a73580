// The offload engine's decode merge (engine/offload/cuda_step.py MergeBuffers): out = a + b, or a alone (has_b 0),
// float32 in, written in the dense part's dtype (DT_F32 / DT_F16), in one launch where CuPy took an add and a
// converting copy (two calls, 40-80 µs of host time a layer in the H200 machine's profiles). fp32 sum, then one
// rounding to fp16: the same values as that add and copy.
extern "C" __global__ void merge_sum(const float* __restrict__ a, const float* __restrict__ b, int has_b,
                                     void* __restrict__ out, int out_dt, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = has_b ? a[i] + b[i] : a[i];
        if (out_dt == DT_F16) {
            ((u16*)out)[i] = f2h(v);
        } else {
            ((float*)out)[i] = v;
        }
    }
}
