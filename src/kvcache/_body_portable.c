/* The portable body of every kernel family: plain C for the baseline of the target, the bits
 * every other body reproduces (_dispatch.h).  Built on every machine. */
#ifndef KVC_NO_SIMD
#define KVC_NO_SIMD 1
#endif
#define KVC_BODY_TABLE kvc_ops_portable
#define KVC_BODY_NAME "portable"
#define KVC_BODY_ID KVC_ISA_PORTABLE
#include "_body.h"
