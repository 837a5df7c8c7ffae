"""Model definitions, layers and loaders."""
