"""The graph's vocabulary: structure matching, tensor access, the qc operator library and its registry."""
