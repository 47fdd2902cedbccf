/* The entry points of one kernel unit (_body.h): each takes the descriptors of _dispatch.h
 * (kvc_store, kvc_call, kvc_task, kvc_o1, kvc_mla) and the range of its task, finds its
 * group's rows and its queries in them, and calls the family's own function with the
 * arguments that function has always taken.  No arithmetic happens here, so the bits are
 * the kernels' own (docs/numerics.md).
 *
 * Included by _body.h after every family; every function here runs the unit's own body. */
#ifndef KVCACHE_ENTRY_H
#define KVCACHE_ENTRY_H

#include "_dispatch.h"

/* base + off, or NULL where the array is absent (an unused or empty store) */
#define KVC_AT(base, off) ((base) ? (base) + (off) : NULL)

/* ---------------------------------------------------------------------------------------
 * decode (attend_rows): every task holds all the queries of its group, t->j0 .. t->j1
 * ------------------------------------------------------------------------------------- */

static void kvc_entry_task_scores(const kvc_store *s, const kvc_call *c, const kvc_task *t)
{
    const ptrdiff_t hd = s->hd, j0 = t->j0;
    kvc_task_scores(c->q + j0 * hd, t->j1 - j0, c->qf + j0, c->qe + j0,
                    s->kf + t->g * s->kcap * hd, t->p0, t->p1, hd, c->scale, c->softcap,
                    c->probs + j0 * c->L, c->L);
}

static void kvc_entry_task_scores_i8(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                                     float *scratch)
{
    const ptrdiff_t hd = s->hd, j0 = t->j0, ng = KVC_I8_GROUPS(hd, s->k_group);
    kvc_task_scores_i8(s->k_group, c->qi + j0 * KVC_I8_PAD(hd), c->qsc + j0 * ng,
                       c->qsum + j0 * ng, t->j1 - j0, c->qf + j0, c->qe + j0,
                       s->kq + t->g * s->kcap * hd, s->ks + t->g * s->kcap * s->ks_stride,
                       s->ks_stride, t->p0, t->p1, hd, c->scale, c->softcap,
                       c->probs + j0 * c->L, c->L, scratch);
}

/* Group g's 4-bit K as the scorer reads it. */
KVC_INLINE kvc_k4 kvc_entry_k4(const kvc_store *s, ptrdiff_t g)
{
    kvc_k4 k;
    const ptrdiff_t hd = s->hd;
    k.codes = s->kc4 ? s->kc4 + g * s->kcap * (hd / 2) : NULL;
    k.par = s->kp ? s->kp + g * ((s->kcap + KVC_K4_BLOCK - 1) / KVC_K4_BLOCK) * 2 * hd : NULL;
    k.ring = s->kr ? s->kr + g * KVC_K4_RING * hd : NULL;
    k.qlen = s->head_len ? s->head_len[g] / KVC_K4_BLOCK * KVC_K4_BLOCK : 0;
    return k;
}

static void kvc_entry_task_scores_k4(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                                     float *scratch)
{
    const ptrdiff_t hd = s->hd, j0 = t->j0;
    kvc_k4 k = kvc_entry_k4(s, t->g);
    kvc_task_scores_k4(&k, c->q + j0 * hd, t->j1 - j0, c->qf + j0, c->qe + j0, t->p0, t->p1,
                       hd, c->scale, c->softcap, c->probs + j0 * c->L, c->L, scratch);
}

static void kvc_entry_task_values(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                                  float *acc, float *scratch)
{
    const ptrdiff_t hd = s->hd, j0 = t->j0, g = t->g;
    if (s->quant_v == KVC_V_Q4) {
        kvc_task_values_v4(c->probs + j0 * c->L, c->L, t->j1 - j0, c->qf + j0, c->qe + j0,
                           s->vc4 + g * s->vcap * (hd / 2),
                           s->vp + g * s->vcap * 2 * KVC_V4_NG(hd), t->p0, t->p1, hd, acc,
                           scratch);
        return;
    }
    kvc_task_values(c->probs + j0 * c->L, c->L, t->j1 - j0, c->qf + j0, c->qe + j0,
                    s->quant_v ? NULL : s->vf + g * s->vcap * hd,
                    s->quant_v ? s->vq + g * s->vcap * hd : NULL,
                    s->quant_v ? s->vs + g * s->vcap * s->vs_stride : NULL, s->quant_v, t->p0,
                    t->p1, hd, acc, scratch);
}

/* The raw q8 scores (no scale, no softcap) of the queries [j0, j1) against every row
 * [p0, p1) of group g: c->probs[j * L + p]. */
static void kvc_entry_q8_rows(const kvc_store *s, const kvc_call *c, const kvc_task *t)
{
    const ptrdiff_t hd = s->hd, ng = KVC_I8_GROUPS(hd, s->k_group);
    const ptrdiff_t row0 = t->g * s->kcap + t->p0;
    ptrdiff_t j;
    for (j = t->j0; j < t->j1; ++j)
        kvc_i8_rows(s->k_group, c->qi + j * KVC_I8_PAD(hd), c->qsc + j * ng, c->qsum + j * ng,
                    s->kq + row0 * hd, s->ks + row0 * s->ks_stride, s->ks_stride, hd,
                    t->p1 - t->p0, c->probs + j * c->L + t->p0);
}

/* ---------------------------------------------------------------------------------------
 * prompt attention (attend_blocked)
 * ------------------------------------------------------------------------------------- */

static void kvc_entry_pf_task(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                              float *scratch, float *pbuf, float *colsum)
{
    const ptrdiff_t hd = s->hd, j0 = t->j0, g = t->g, ng = KVC_I8_GROUPS(hd, s->k_group);
    kvc_k4 k4 = kvc_entry_k4(s, g);
    kvc_pf_task(c->q + j0 * hd, t->j1 - j0, c->qf + j0, c->qe + j0,
                KVC_AT(s->kf, g * s->kcap * hd), KVC_AT(s->kq, g * s->kcap * hd),
                KVC_AT(s->ks, g * s->kcap * s->ks_stride), s->ks_stride, s->quant_k, &k4,
                KVC_AT(s->vf, g * s->vcap * hd), KVC_AT(s->vq, g * s->vcap * hd),
                KVC_AT(s->vs, g * s->vcap * s->vs_stride), s->vs_stride, s->quant_v,
                KVC_AT(s->vc4, g * s->vcap * (hd / 2)),
                KVC_AT(s->vp, g * s->vcap * 2 * KVC_V4_NG(hd)), KVC_AT(s->vcol, g * hd), hd, c->scale, c->softcap, c->out + j0 * hd,
                c->qm + j0, c->ql + j0, scratch, pbuf, colsum, s->k_group,
                KVC_AT(c->qi, j0 * KVC_I8_PAD(hd)), KVC_AT(c->qsc, j0 * ng),
                KVC_AT(c->qsum, j0 * ng));
}

/* ---------------------------------------------------------------------------------------
 * O(1) step
 * ------------------------------------------------------------------------------------- */

/* Absorb the key k (d floats) and value v (dv floats) into head h's far field; scr: m floats. */
static void kvc_entry_o1_absorb(const kvc_o1 *o, ptrdiff_t h, const float *k, const float *v,
                                float *scr)
{
    const ptrdiff_t m = o->m;
    kvc_o1_absorb(o->q_tilde + h * m * o->d, k, v, m, o->d, o->dv, o->scale,
                  o->t_hat + h * m * o->dv, o->z_hat + h * m, o->m_max + h * m, scr);
}

/* Head h's part of a step: when o->absorb, absorb the ring row at o->slot (the key leaving a
 * full window) into its far field; then its output.  The ring itself is written by the
 * caller, after every head. */
static void kvc_entry_o1_step_head(const kvc_o1 *o, ptrdiff_t h)
{
    const ptrdiff_t g = h / o->hpk, m = o->m, d = o->d, dv = o->dv, ns = o->ns;
    float *scr = o->scr + h * o->scr_stride;
    if (o->absorb && m > 0)
        kvc_entry_o1_absorb(o, h, o->win_k + (g * o->cap + o->slot) * d,
                            o->win_v + (g * o->cap + o->slot) * dv, scr + ns + o->win_len + 2 * m);
    kvc_o1_head(o->q + h * d, d, dv, o->scale, ns > 0 ? o->sink_k + g * ns * d : NULL,
                ns > 0 ? o->sink_v + g * ns * dv : NULL, ns, KVC_AT(o->win_k, g * o->cap * d),
                KVC_AT(o->win_v, g * o->cap * dv), o->win_len, o->slot, o->k_new + g * d,
                o->v_new + g * dv, m > 0 ? o->k_tilde + g * m * d : NULL,
                m > 0 ? o->mu + h * m * m : NULL, m > 0 ? o->t_hat + h * m * dv : NULL,
                m > 0 ? o->z_hat + h * m : NULL, m > 0 ? o->m_max + h * m : NULL, m,
                o->use_far, o->fm, o->out + h * dv, scr);
}

/* ---------------------------------------------------------------------------------------
 * MLA decode: the current group of positions starts at a->i0
 * ------------------------------------------------------------------------------------- */

static void kvc_entry_mla_fold(const kvc_mla *a, ptrdiff_t task)
{
    const ptrdiff_t i = task / a->H, h = task % a->H, row = (a->i0 + i) * a->H + h;
    kvc_mla_fold(a->qn + row * a->dn, a->dr > 0 ? a->qr + row * a->dr : a->qn,
                 a->dn > 0 ? a->wuk + h * a->dn * a->r : NULL, a->dn, a->r, a->dr, h, a->Hp,
                 a->qa + task * a->r, a->qT + i * (a->r + a->dr) * a->Hp);
}

/* Task (i, c): the rows [c R, min((c + 1) R, e)) of position i, which sees [0, e); a task
 * past e holds no row (running max -inf, sum 0).  S: KVC_MLA_BLOCK x Hp scratch. */
static void kvc_entry_mla_task(const kvc_mla *a, ptrdiff_t task, float *S)
{
    const ptrdiff_t i = task / a->NT, c = task % a->NT, e = a->T - a->n + a->i0 + i + 1;
    const ptrdiff_t p0 = c * a->R, p1 = p0 + a->R < e ? p0 + a->R : e;
    float *m = a->m + task * a->Hp, *l = a->l + task * a->Hp;
    ptrdiff_t h;
    if (p0 < p1) {
        kvc_mla_task(a->qT + i * (a->r + a->dr) * a->Hp, a->H, a->Hp, a->lat,
                                      a->kr, a->r, a->dr, p0, p1, e, a->scale,
                                      a->acc + task * a->H * a->r, m, l, S);
    } else {
        for (h = 0; h < a->Hp; ++h) {
            m[h] = -INFINITY;
            l[h] = 0.0f;
        }
    }
}

static void kvc_entry_mla_merge(const kvc_mla *a, ptrdiff_t task)
{
    const ptrdiff_t i = task / a->H, h = task % a->H, t0 = i * a->NT;
    kvc_mla_merge_head(a->acc + (t0 * a->H + h) * a->r, a->H * a->r, a->m + t0 * a->Hp + h,
                       a->l + t0 * a->Hp + h, a->Hp, a->NT, a->wuv + h * a->dv * a->r, a->r,
                       a->dv, a->c + task * a->r, a->out + ((a->i0 + i) * a->H + h) * a->dv);
}

static const char *kvc_entry_mla_path(void)
{
    return KVC_MLA_PATH;
}

#undef KVC_AT

#endif
