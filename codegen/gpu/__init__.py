"""GPU targets (cuda, vulkan, metal): schedules, hand-written GPU kernels, weight layout, the dispatch
plan and the build."""
