# Mirrors include/gs_info.h.
cdef extern from "gs_info.h" nogil:
    const char *gs_version()
    const char *gs_simd_level()
    int gs_cuda_version()
    int gs_nccl_version()
    long long gs_default_fusion_threshold()
    int gs_check_payload_bytes()
