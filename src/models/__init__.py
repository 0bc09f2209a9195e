"""Networks (`simplenet`, `cnn`) and the LightningModules that train them."""
