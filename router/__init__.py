"""The kvroute proxy service. Must never import torch or vllm (keep the proxy light)."""
