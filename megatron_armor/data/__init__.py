"""Prompt data: DAPO-Math and benchmark schemas, prompt templates, a resumable sampler."""

from megatron_armor.data.dataset import PromptDataset, PromptItem, load_prompt_dataset
from megatron_armor.data.sampler import ResumableSampler, SamplerExhausted
from megatron_armor.data.templates import TEMPLATES, format_dapo_prompt, strip_dapo_instruction

__all__ = [
    "TEMPLATES",
    "PromptDataset",
    "PromptItem",
    "ResumableSampler",
    "SamplerExhausted",
    "format_dapo_prompt",
    "load_prompt_dataset",
    "strip_dapo_instruction",
]
