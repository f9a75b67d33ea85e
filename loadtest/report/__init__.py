"""Reports of replay results: rich tables (:mod:`.tables`), PNG plots and an HTML page."""
