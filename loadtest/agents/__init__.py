"""Real agent CLIs against kvroute."""
