"""The ClientApp: one client's personalized training and evaluation."""
