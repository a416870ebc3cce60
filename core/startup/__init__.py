"""Start-up: kernel warm-up, the kernel self-check and the count of Triton JIT compiles."""
