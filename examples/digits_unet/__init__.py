"""A small U-Net on scikit-learn's bundled 8x8 digits: skip connections across pipeline stages and BatchNorm."""
