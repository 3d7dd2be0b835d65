"""Model families; importing a module registers its models with timm."""
