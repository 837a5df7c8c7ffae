"""Building blocks of the decoder: linear, norm, rotary, paged attention, sampler."""
