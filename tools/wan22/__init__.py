"""Wan2.2 offline tools (the I2V diffusers assembly tool and its parts)."""
