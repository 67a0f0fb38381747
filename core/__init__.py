"""What every stage may import: atomic writes, typed-contract validation, devices, memory figures,
exact streaming top-k and the CLI's clean failure. It imports nothing else of the project."""
