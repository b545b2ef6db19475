"""KV memory: the slot allocator (torch-free), the KV pool and the block table (torch).

``radixkv.memory.allocator.SlotAllocator`` and :mod:`radixkv.memory.slots` import without torch;
``radixkv.memory.kv_pool`` (``KVPool``, ``ReqToTokenPool``) needs it. Nothing is imported eagerly
here, so the prefix caches can use the allocator where torch is not installed.
"""
