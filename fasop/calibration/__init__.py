"""Estimates against measured runs: reading the runs, scoring the estimates, fitting correction factors."""
