/* The body of one kernel translation unit (_body_*.c): every kernel family compiled for the
 * unit's target, its entry points (_entry.h) and the unit's table of them (_dispatch.h),
 * named KVC_BODY_TABLE, for body KVC_BODY_ID named KVC_BODY_NAME. */
#ifndef KVCACHE_BODY_H
#define KVCACHE_BODY_H

#include "_prefill.h"
#include "_mla.h"
#include "_dispatch.h"
#include "_entry.h"

const kvc_ops KVC_BODY_TABLE = {
    KVC_BODY_NAME,
    kvc_entry_task_scores, kvc_entry_task_scores_i8, kvc_entry_task_scores_k4,
    kvc_entry_task_values, kvc_entry_q8_rows,
    kvc_axpy_f32, kvc_softmax,
    kvc_quant_row, kvc_quant_query,
    kvc_entry_pf_task,
    kvc_entry_o1_absorb, kvc_entry_o1_step_head,
    kvc_entry_mla_fold, kvc_entry_mla_task, kvc_entry_mla_merge, kvc_entry_mla_path,
    kvc_fma_probe,
    KVC_BODY_ID,
};

#endif
