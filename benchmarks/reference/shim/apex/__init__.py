"""CPU stand-in for the parts of NVIDIA apex the SeedVR reference imports (``apex.normalization``)."""
