"""``kvroute bench``: concurrency sweeps of several routers against the same twin cluster."""
