"""Power attention p = 2, GPT-2-small widths, the power-attention paper's Appendix D recipe.

12 layers, d_model 768, 12 heads of 64 (spow state D = 2080 per head), gated, context
1024, batch 32, lr 3e-4 (2000 warm-up steps, cosine to 1e-5), AdamW beta2 0.999.
"""

from train.config import finalize
from train.presets import power_paper_config


def get_config():
  return finalize(power_paper_config("s", p=2))
