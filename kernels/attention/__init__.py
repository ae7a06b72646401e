"""Triton attention kernels over the paged KV pool: decode (flash-decoding), extend over a cached prefix,
shared-prefix (cascade) decode. Tensors in, tensors out; the backends that drive them from a ForwardBatch
live in shared/models/attention/, their torch references in kernels/reference.py."""
