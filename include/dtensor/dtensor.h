#pragma once
// Everything a program using dtensor-cpp needs.
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/placement.h"
#include "dtensor/core/redistribute.h"
#include "dtensor/dispatch/cache.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/dispatch/op_call.h"
#include "dtensor/mesh/device_mesh.h"
