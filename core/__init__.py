"""What every stage may import: atomic writes and staged folders, typed-contract validation,
devices, memory figures, the exact streaming top-k, bounded decoding of untrusted images and the
CLI's clean failure. It imports nothing else of the project."""
