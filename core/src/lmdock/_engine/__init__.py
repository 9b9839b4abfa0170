"""The core's generation engine for step backends: scheduler, sampler, detokenizer and the loop."""
