// The defaults of the ops' tuning arguments, written by `python3 cosa/defaults.py >
// csrc/cosa_defaults.h` from cosa/defaults.py, their one source (tests/test_ops.py fails when
// this file is stale). Edit that file, not this one.
#pragma once

// As the op schemas of csrc/torch_binding.cpp spell them (strings bare: the binding quotes them).
#define COSA_DEFAULT_STRIDE 8
#define COSA_DEFAULT_TOP_P 0.95
#define COSA_DEFAULT_SOFTMAX_SCALE None
#define COSA_DEFAULT_DELTA 2000.0
#define COSA_DEFAULT_VOTE warpgroup
#define COSA_DEFAULT_PROXY_PRECISION auto

// The enumerators of csrc/cosa_params.h that the string defaults name.
#define COSA_DEFAULT_VOTE_SCOPE kWarpgroup
#define COSA_DEFAULT_PROXY_PRECISION_ENUM kAuto

// proxy_precision "auto" takes the fp8 proxy from this many keys (the longest sequence's).
#define COSA_FP8_PROXY_MIN_KEYS 8192

// The fp8 proxy centres the keys on the channel midpoints of every this-many-th key.
#define COSA_KEY_CENTRE_STRIDE 8
