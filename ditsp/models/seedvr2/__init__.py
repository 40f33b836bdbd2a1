"""SeedVR2: the NaDiT diffusion transformers (3B, 7B), their SP wiring, sizing, VAE and restoration pipeline."""
