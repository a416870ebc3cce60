"""The paged KV cache: the block allocator, block tables per request, the radix prefix cache."""
