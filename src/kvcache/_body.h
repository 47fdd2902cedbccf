/* The body of one kernel translation unit (_body_*.c): every kernel family compiled for the
 * unit's target, and the unit's table of entry points (_dispatch.h) named KVC_BODY_TABLE for
 * body KVC_BODY_ID named KVC_BODY_NAME. */
#ifndef KVCACHE_BODY_H
#define KVCACHE_BODY_H

#include "_prefill.h"
#include "_mla.h"
#include "_dispatch.h"

const kvc_ops KVC_BODY_TABLE = {
    KVC_BODY_NAME,
    kvc_task_scores, kvc_task_values, kvc_axpy_f32, kvc_softmax,
    kvc_quant_row, kvc_quant_query,
    kvc_o1_absorb, kvc_o1_head,
    kvc_task_scores_i8, kvc_i8_rows_isa,
    kvc_pf_task, kvc_pf_imp_group,
    kvc_mla_fold, kvc_mla_task_for, kvc_mla_path_for, kvc_mla_merge_head,
    kvc_fma_probe,
    KVC_BODY_ID,
};

#endif
