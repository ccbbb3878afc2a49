"""Layer library: Flax linen, Flax NNX and Haiku layers that declare logical axes."""
