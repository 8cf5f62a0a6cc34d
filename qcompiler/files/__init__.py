"""The ground floor for files: atomic writes that never delete what they did not write, reading
only regular files, spilling tensors to disk, streaming and sharding safetensors. It imports
nothing of qcompiler above ``errors``, so every room above (frontend, pipeline, store, interop)
can write files the same safe way."""
