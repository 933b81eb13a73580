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

// The decode merge of a "both" step queued before the CPU's part exists (kernels/gpu/published.py), so that the host
// need not queue it after computing that part: each block waits until the host raises the gate to this launch's
// number (route_split's count of its runs, `seq`), then adds the CPU's part, read over PCIe from page-locked host
// memory, to the GPU's part `a`, written in out_dt. A gate not raised within timeout_ns (a host that failed) sets the
// host-visible `failed` word and leaves the GPU's part alone, so that the GPU is not held for ever.
extern "C" __global__ void merge_gated(const unsigned* __restrict__ seq, const volatile unsigned* gate,
                                       const volatile float* host_part, const float* __restrict__ a,
                                       void* __restrict__ out, int out_dt, int n, long long timeout_ns,
                                       volatile unsigned* failed) {
    __shared__ int opened;
    if (threadIdx.x == 0) {
        const unsigned want = *seq;
        unsigned long long started, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(started));
        unsigned seen = *gate;
        while (seen != want) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
            __nanosleep(128);
#endif
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if ((long long)(now - started) > timeout_ns) {
                break;
            }
            seen = *gate;
        }
        opened = seen == want;
        if (!opened) {
            *failed = want;
        } else if (blockIdx.x == 0) {
            // when the merge began to wait and when it saw the gate, on the GPU's clock, beside the failed word
            // (PublishedRouting.gpu_times: where a "both" layer's time goes, benchmarks/diag_worker_parts.py)
            unsigned long long seen_at;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(seen_at));
            volatile unsigned long long* times = reinterpret_cast<volatile unsigned long long*>(failed + 2);
            times[0] = started;
            times[1] = seen_at;
        }
        __threadfence_system();  // the part's reads after the gate's
    }
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        store_f(out, i, out_dt, opened ? a[i] + host_part[i] : a[i]);
    }
}
