"""existingapp: an ordinary Flower Message-API app (PyTorch, sklearn digits)."""
